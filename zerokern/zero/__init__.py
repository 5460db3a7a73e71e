from .optimizer import ZeroAdamW

__all__ = ["ZeroAdamW"]
