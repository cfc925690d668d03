"""The compiled pieces of hiradix, both optional: where no C compiler is found the package
installs without them and runs the same checks in Python and torch.

- ``hiradix._pagebits``: the page allocator's loops in C (issue 13; ``hiradix._slots.core``).
- ``hiradix._tokens``: a key's tokens checked and packed in one C pass (issue 29;
  ``hiradix.keys``)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("hiradix._pagebits", ["impl/hiradix/_pagebits.c"], extra_compile_args=["-O2"],
              optional=True),
    Extension("hiradix._tokens", ["impl/hiradix/_tokens.c"], extra_compile_args=["-O2"],
              optional=True),
])
