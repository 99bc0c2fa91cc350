"""Draft providers: model-free prompt lookup and a second model."""
