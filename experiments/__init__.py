"""Research experiments (ablations, ARC diagnostics, perturbation and representation studies).

Not shipped: a layer above the library, actors, tune and api that none of them imports. Each
module runs as `python -m experiments.<name>`; bench/ holds the product benchmarks.
"""
