"""The fuzzer of rank-divergent programs (issue 59, item 6): small multi-rank programs drawn by hypothesis, run on real
gloo process groups, each judged by an oracle that reads only the program.

- :mod:`launch.fuzz.programs`: the program (each rank's steps and the setup they share), its model and inputs, and
  the hypothesis strategy that draws it;
- :mod:`launch.fuzz.oracle`: the table of classes (docs/troubleshooting.md, "What is caught, and when", is this table)
  and the decision: which class a program is in, and what each rank must then do;
- :mod:`launch.fuzz.runner`: a program on one rank, a program on its ranks, and the check of what they did against the
  oracle and float64 ``nn.BatchNorm`` on each layer's union of batches;
- :mod:`launch.fuzz.repro`: a failure as a script that reproduces it;
- ``python -m launch.fuzz``: ``make fuzz``, many programs with a random seed.

tests/test_fuzz.py runs a fixed seed of the same strategy, oracle and check.
"""
