"""fadrm-ray: FADRM dataset distillation (pure PyTorch library; the Ray layer lives in `actors`)."""

__version__ = "0.1.0"
