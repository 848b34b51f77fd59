"""The project's benchmarks (not part of the installed package): ``python -m benchmarks
--help`` lists them; benchmarks/lib/ holds the helpers they share."""
