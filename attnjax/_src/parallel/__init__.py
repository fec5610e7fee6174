"""Context parallelism: attention over a sequence sharded across devices.

Implementation behind the public module :mod:`attnjax.parallel`, which names what it offers
from the modules of this package.
"""
