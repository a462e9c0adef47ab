"""Builds the optional compiled kernels of the buddy placer
(src/tidal/scheduler/_fastbits.c); everything else is in pyproject.toml.
Without a C compiler the package installs without them and runs the same
numpy code they replace."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tidal.scheduler._fastbits", ["src/tidal/scheduler/_fastbits.c"], optional=True)])
