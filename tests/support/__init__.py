"""What the tests share, and nothing else: models, batches and the one-device reference, the rigs that drive an
actor alone, the multi-process harness, the plain PyTorch loop.

Imported as ``tests.support.<module>`` (pytest puts the repository root on the path: ``pythonpath`` in
pyproject.toml); a test module imports its helpers from here, never from another test module (the NCCL
conformance file, which runs the conformance cases themselves, loads them by path). ``plain_loop`` and ``harness``
are also what ``bench/`` and ``tools/`` start from, so "the plain loop" and "a rank" mean one thing everywhere; they
import only the standard library and torch.
"""
