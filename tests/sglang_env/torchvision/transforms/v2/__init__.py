from torchvision.transforms.v2 import functional  # noqa: F401
