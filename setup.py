"""Builds the optional compiled kernels of the buddy placer
(src/tidal/scheduler/_fastbits.c); everything else is in pyproject.toml.
Without a C compiler the package installs without them and runs the same
numpy code they replace."""

from setuptools import Extension, setup

# -ffp-contract=off: a product and a sum stay two roundings, as in numpy (no fused multiply-add)
setup(ext_modules=[Extension("tidal.scheduler._fastbits", ["src/tidal/scheduler/_fastbits.c"],
                             extra_compile_args=["-ffp-contract=off"], optional=True)])
