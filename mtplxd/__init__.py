"""mtplxd: the mtplx daemon (MTP engine, HTTP API, control plane, memory guard, fans)."""

__version__ = "0.1.0"

POWERED_BY = "Powered by MTPLX"
