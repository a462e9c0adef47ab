"""A script that sleeps (a slow download, a lock) before ``tidal.runtime.init()``."""

import time

from train import fault, parse, train

fault("sleeps 600 s before init")
time.sleep(600)
train(parse())
