"""Compatibility layers: other data planes' client APIs, built on :class:`~tq.TQClient`.

- :mod:`tq.compat.transfer_queue` - the KV API of the ``transferqueue`` package (0.1.11):
  ``import tq.compat.transfer_queue as tq`` instead of ``import transfer_queue as tq``.
- :mod:`tq.compat.nemo_rl` - NeMo-RL's ``DataPlaneClient`` interface.

Both need the ``compat`` extra (``pip install 'tq-rl[compat]'``: tensordict and omegaconf). See
docs/compat.md.
"""
