"""Engines: each kernel with its tiles, backward and autodiff rules, one package or module each.

Implementation behind the public module :mod:`attnjax.kernels`.
"""
