"""Wyoming discovery for the add-on: once the server answers on its port, tell Home Assistant's Supervisor
where it is (POST /discovery, service "wyoming", as its Wyoming integration expects), so the integration offers
it without the user typing a host. Plain Python: no bashio."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request

WAIT_S = 1800  # the model loads first: the official one takes minutes on a small CPU


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def main(port: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while not listening(port):
        if time.monotonic() > deadline:
            print("cosyllama discovery: the Wyoming server never listened; not announced", file=sys.stderr)
            return 1
        time.sleep(2)
    body = json.dumps({"service": "wyoming", "config": {"uri": f"tcp://{socket.gethostname()}:{port}"}}).encode()
    request = urllib.request.Request("http://supervisor/discovery", data=body, method="POST", headers={
        "Authorization": f"Bearer {os.environ['SUPERVISOR_TOKEN']}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            print(f"cosyllama discovery: announced tcp://{socket.gethostname()}:{port} ({r.status})", file=sys.stderr)
    except OSError as e:
        print(f"cosyllama discovery: the Supervisor refused the announcement: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10200))
