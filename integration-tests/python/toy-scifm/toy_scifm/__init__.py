from .model import ToySurrogate

__all__ = ["ToySurrogate"]
