"""Adapters to training frameworks.

Each framework lives in its own module and is imported only when asked for, so the core
package never needs the framework installed::

    from ddp_ring_hooks.integrations.lightning import RingDDPStrategy   # needs `lightning`
"""
