"""The digits recipes: train a small BatchNorm CNN on scikit-learn's digits (:mod:`launch.digits.train`)."""
