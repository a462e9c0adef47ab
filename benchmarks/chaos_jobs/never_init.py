"""A script that forgot ``tidal.runtime.init()``: it prints and exits 0."""

from train import fault

fault("exits 0 without calling tidal.runtime.init()")
print("training done (or so this script thinks)")
