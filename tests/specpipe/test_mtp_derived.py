"""A round's draft inputs derived on the device from the last round's
(`models.mtp_cuda.derive_inputs`, the fused kernel's DERIVE prologue): in
every round that can derive them, they equal the inputs the round builds
from the rows' host state (tail ids, the tail's last position, starts, seeds,
step keys), over real rounds with none, some and all drafts accepted, batched
rows, greedy and sampled; rows joining or leaving, and rows not offered
every draft, leave nothing to derive from. Run here on the CPU (the kernel
itself is compile-checked in tests/models/test_mtp_cuda.py and checked on a
GPU by bench/draft_device.py --check)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from attrs import evolve
from spec_support import run
from test_mtp import CONFIG, PROMPTS, SAMPLINGS, copy_head, random_head
from test_mtp import target as mtp_target  # noqa: F401  (pytest fixture)
from test_mtp_compiled import repeating_target

from models import mtp_cuda
from models.base import ModelOutput
from schemas.request import DraftPolicy, SamplingParams
from specpipe.draft import Proposal
from specpipe.drafts.mtp import MtpDrafter, MtpRows
from specpipe.prefill import prefill_rows
from specpipe.state import RowState


def derived_rounds(
    monkeypatch: pytest.MonkeyPatch,
    model: Any,
    head: Any,
    prompts: Any,
    sampling: SamplingParams,
    depth: int,
) -> list[tuple[int, ...]]:
    """Run MTP decoding; in every round whose rows carry a device chain,
    check the derived inputs against the host-built ones. Per such round,
    the rows' accepted counts of the last round."""
    seen: list[tuple[int, ...]] = []
    propose = MtpRows.propose

    def checking(self: MtpRows, rows: Any, asked: int) -> Proposal:
        chain = self.chain
        if chain is not None and asked > 0:
            params = [self.policy.draft_params(row.sampling) for row in rows]
            host = self.round_arrays(rows, asked, params)
            width = host[0].shape[1]
            derived = mtp_cuda.derive_inputs(
                chain.samples, chain.drafts, chain.prev, width
            )
            wanted = (host[0], host[2], host[3], host[6], host[7])
            for name, got, want in zip(("ids", "last", "starts", "seeds", "steps"),
                                       derived, wanted, strict=True):  # fmt: skip
                assert got.dtype == want.dtype, name
                assert got.tolist() == want.tolist(), name
            # the launch's state, as the kernel writes it, is what the next derives from
            assert (
                mtp_cuda.state_of(*derived[1:]).tolist()
                == mtp_cuda.state_of(host[2], host[3], host[6], host[7]).tolist()
            )
            seen.append(tuple(n - 1 for n in self.tail_lengths))
        return propose(self, rows, asked)

    monkeypatch.setattr(MtpRows, "propose", checking)
    drafter = MtpDrafter(model, head, DraftPolicy(compiled=True))
    plain, _ = run(model, prompts, sampling, max_tokens=14)
    out, results = run(model, prompts, sampling, drafter, depth, max_tokens=14)
    assert out == plain
    assert all(r.metrics.draft_errors == [] for r in results)
    return seen


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.7-filters"])
def test_random_head_rounds_derive_the_host_inputs(
    monkeypatch: pytest.MonkeyPatch,
    mtp_target: Any,  # noqa: F811
    sampling: SamplingParams,
) -> None:
    seen = derived_rounds(
        monkeypatch, mtp_target, random_head(3), PROMPTS[:3], sampling, 3
    )
    assert len(seen) >= 3


def test_rounds_accepting_every_draft_derive_the_host_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repeating = repeating_target()
    prompts = [(3, 3, 3, 3), (7, 1, 7, 5, 5), (2, 2)]
    seen = derived_rounds(monkeypatch, repeating, copy_head(repeating), prompts,
                          SamplingParams(), 3)  # fmt: skip
    assert any(max(a) == 3 for a in seen)  # wide tails: ids padded to 4


def test_rounds_accepting_some_drafts_derive_the_host_inputs(
    monkeypatch: pytest.MonkeyPatch,
    mtp_target: Any,  # noqa: F811
) -> None:
    seen = derived_rounds(monkeypatch, mtp_target, copy_head(mtp_target), PROMPTS[:3],
                          SamplingParams(), 2)  # fmt: skip
    assert seen


def _opened(model: Any, rows: int) -> tuple[MtpRows, list[RowState]]:
    """MTP rows after two rounds with nothing accepted (the second from a
    one-token tail, so the second leaves a chain)."""
    drafter = MtpDrafter(model, random_head(1), DraftPolicy(compiled=True))
    states = [RowState.start((5 + b, 6, 7), 32, SamplingParams()) for b in range(rows)]
    cache, hidden = prefill_rows(model, states, keep_hidden=True)
    opened = drafter.open(states, hidden)
    assert isinstance(opened, MtpRows)
    for _ in range(2):
        proposal = opened.propose(states, 2)
        assert proposal.device is not None
        window = mx.concatenate(
            [mx.array([[s.pending] for s in states], dtype=mx.int32), proposal.device],
            axis=1,
        )
        verified = model(window, cache, [s.length for s in states])
        draws = mx.argmax(verified.logits, axis=-1).astype(mx.int32)
        drafts = [tuple(r) for r in proposal.device.tolist()]
        accepted = [0] * rows
        committed = opened.prepare_commit(
            states, proposal, drafts, accepted, evolve(verified, draws=draws)
        ).commit()
        assert isinstance(committed, MtpRows)
        opened = committed
        if verified.delta is not None:
            verified.delta.commit([1] * rows)
        states = [
            s.advanced((int(t),))
            for s, t in zip(states, draws[:, 0].tolist(), strict=True)
        ]
    return opened, states


def test_rows_joining_or_leaving_leave_no_chain(mtp_target: Any) -> None:  # noqa: F811
    opened, _ = _opened(mtp_target, 3)
    assert opened.chain is not None
    left = opened.take_rows([0, 2])
    assert isinstance(left, MtpRows) and left.chain is None
    joined = opened.join(_opened(mtp_target, 1)[0])
    assert isinstance(joined, MtpRows) and joined.chain is None


def test_rows_not_offered_every_draft_leave_no_chain(mtp_target: Any) -> None:  # noqa: F811
    opened, states = _opened(mtp_target, 2)
    proposal = opened.propose(states, 2)
    assert proposal.device is not None and proposal.state is not None
    hidden = mx.zeros((2, 3, CONFIG["hidden_size"]))
    drafted = [tuple(r) for r in proposal.device.tolist()]
    out = mx.zeros((2, 3, 1))
    verified = ModelOutput(out, hidden, draws=mx.zeros((2, 3), dtype=mx.int32))
    # row 1 asked for one draft only (a per-row depth): its count is not the device's
    short = opened.prepare_commit(states, proposal, [drafted[0], drafted[1][:1]], [0, 0],
                                  verified).commit()  # fmt: skip
    assert isinstance(short, MtpRows) and short.chain is None
    full = opened.prepare_commit(states, proposal, drafted, [0, 0], verified).commit()
    assert isinstance(full, MtpRows) and full.chain is not None
    # a round without the draws (a caller that does not set them) neither
    bare = opened.prepare_commit(states, proposal, drafted, [0, 0],
                                 ModelOutput(out, hidden)).commit()  # fmt: skip
    assert isinstance(bare, MtpRows) and bare.chain is None


def test_without_derived_inputs_no_state_is_kept(
    monkeypatch: pytest.MonkeyPatch,
    mtp_target: Any,  # noqa: F811
) -> None:
    monkeypatch.setattr(mtp_cuda, "DERIVED_INPUTS", False)
    opened, states = _opened(mtp_target, 1)
    assert opened.chain is None
    assert opened.propose(states, 2).state is None
