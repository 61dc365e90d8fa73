"""What the recipes and the tests share: typed configs, atomic writes, the torchrun runner, op and collective
counting.
"""
