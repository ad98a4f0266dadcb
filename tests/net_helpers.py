"""Shared by the tests that start a server (JupyterLab, the OpenAI-compatible server) on loopback."""
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at this moment (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
