"""attrs records for configs, artifacts and requests, and their cattrs converters."""
