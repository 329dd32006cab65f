"""Which proxies' X-Forwarded-For the service believes (FADRM_TRUSTED_PROXIES), said at start and
checked on every request.

`TrustedProxies` (ASGI middleware, outermost) reads X-Forwarded-For only from the operator's
proxies (uvicorn's own `ProxyHeadersMiddleware`, handed them alone: uvicorn's default would
trust loopback, where the service binds by default, so any client could name its own address),
and not at all without them. The first request that carries forwarding headers (X-Forwarded-For,
Forwarded, X-Real-IP) from a peer that is not a named proxy is logged, once per peer (a client
that sends them does not use up the warning the real proxy's address needs), naming that peer: the
address to name is the one the proxy connects from, as the service sees it, which is not always
the one it listens on (a proxy in another network namespace or container, or behind NAT, connects
from another). `trusted_line` is what the service logs as it starts.
"""
from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger("fadrm.api")
FORWARDING = (b"x-forwarded-for", b"forwarded", b"x-real-ip")
WARNED_PEERS = 16  # the stray forwarding peers said in the log, each once


def trusted_line(trusted: tuple[str, ...]) -> str:
    if not trusted:
        return ("trusted proxies (FADRM_TRUSTED_PROXIES): none; X-Forwarded-For is not read, every client is the "
                "socket's peer")
    return (f"trusted proxies (FADRM_TRUSTED_PROXIES): {', '.join(trusted)}; X-Forwarded-For is read from these "
            f"peers only")


class TrustedProxies:
    """ASGI middleware (module docstring)."""

    def __init__(self, app, trusted: tuple[str, ...]):
        from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

        self.app = ProxyHeadersMiddleware(app, trusted_hosts=list(trusted)) if trusted else app
        self.trusted, self.networks = trusted, [ipaddress.ip_network(t, strict=False) for t in trusted]
        self.warned: set[str] = set()  # the peers said so far, at most WARNED_PEERS

    def _is_trusted(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(self.warned) < WARNED_PEERS:
            peer = (scope.get("client") or ("", 0))[0]
            if (peer and peer not in self.warned and not self._is_trusted(peer)
                    and any(name in FORWARDING for name, _ in scope["headers"])):
                self.warned.add(peer)
                log.warning("a request from %s carries forwarding headers (X-Forwarded-For), but %s is not a trusted "
                            "proxy (FADRM_TRUSTED_PROXIES: %s): if it is your proxy, every client it forwards counts "
                            "as %s; then name this address in FADRM_TRUSTED_PROXIES: the one it connects from, as the "
                            "service sees it, not the one it listens on. (Said once per address, for the first %d.)",
                            peer, peer, ", ".join(self.trusted) or "none", peer, WARNED_PEERS)
        return await self.app(scope, receive, send)
