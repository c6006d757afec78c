"""``kvlab eval`` with the method ``pn-mix-mse`` registered for this run only (kvlab issue 19).

``pn-mix-mse`` is ``pn-mix`` with ``value_coding="hadamard_mse"``
(:class:`kvlab.pnmix.values.MSEHadamardValueCodec`: each token's value range chosen by squared
error, same bytes); ``pn-mix-auto`` is ``pn-mix`` with ``value_coding="hadamard_auto"``
(min-max or squared-error ranges per kv head, chosen at its first flush by the
attention-weighted output error). It is not in the built-in registry yet because
tests/evaluation/test_method_grammar.py pins every name and error message as before
(tests/fixtures/methods_before.json); promoting it means one line in
``kvlab.evaluation.methods.builtin.PNMIX_METHODS`` and regenerating that fixture.

    PYTHONPATH=src python experiments/eval_pnmix_mse.py eval --model ... --method pn-mix-mse
"""

from __future__ import annotations

from kvlab.evaluation.methods import PNMIX_METHODS, register_method
from kvlab.evaluation.methods.builtin import build_pnmix

PNMIX_METHODS["pn-mix-mse"] = {**PNMIX_METHODS["pn-mix"], "value_coding": "hadamard_mse"}
register_method("pn-mix-mse", build_pnmix)
PNMIX_METHODS["pn-mix-auto"] = {**PNMIX_METHODS["pn-mix"], "value_coding": "hadamard_auto"}
register_method("pn-mix-auto", build_pnmix)

if __name__ == "__main__":
    from kvlab.cli import main

    main()
