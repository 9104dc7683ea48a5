"""``python -m shardfn.calibrate``: the documented command (docs/search.md, docs/launching.md, SHARDFN_PROFILE's
error), kept working; the calibration itself is :mod:`shardfn.training.calibrate`."""

from .training.calibrate import calibrate, main

__all__ = ["calibrate"]

if __name__ == "__main__":
    main()
