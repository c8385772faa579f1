"""hetero-paged-infer operator: reconciles InferenceDeployment resources into inference pods."""

__version__ = "0.1.0"
