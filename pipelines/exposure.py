"""Who can reach a server: the one rule the web app and the job server share. A loopback address serves this machine
only; any other address is reachable from the network, so the server must ask for a credential (the job server's
token, the web app's sign-in) or be told explicitly to run open (the web app's ``--insecure``)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
