"""Builds the optional C row-copy helper; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

# optional=True: without a compiler the install still succeeds and tq.rowcopy falls back to numpy.
setup(
    ext_modules=[
        Extension("tq._fastcopy", ["tq/_fastcopy.c"], extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"], optional=True)
    ]
)
