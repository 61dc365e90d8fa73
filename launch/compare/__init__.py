"""The plain vs synchronized BatchNorm comparison behind ``make compare`` (entry: :mod:`launch.compare.run`)."""
