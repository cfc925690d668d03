"""The one compiled piece of hiradix: ``hiradix._pagebits``, the page allocator's loops in C
(issue 13). Optional: where no C compiler is found the package installs without it and runs
the same checks as torch ops (``hiradix._slots.core``)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hiradix._pagebits", ["impl/hiradix/_pagebits.c"],
                             extra_compile_args=["-O2"], optional=True)])
