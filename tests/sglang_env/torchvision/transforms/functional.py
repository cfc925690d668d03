from torchvision._unavailable import unavailable


def __getattr__(name: str) -> object:
    # Any image function transformers looks up (pil_to_tensor, resize, ...) exists and raises.
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable
