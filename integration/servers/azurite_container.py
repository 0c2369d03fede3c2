#!/usr/bin/env python3
"""Create a blob container on Azurite with a SharedKey-signed `PUT ?restype=container`.

object_store cannot create containers. Usage:
    azurite_container.py ENDPOINT CONTAINER
ENDPOINT is the account URL, e.g. http://127.0.0.1:10000/devstoreaccount1.
Exit 0 when the container exists afterwards (201 created or 409 already there).
Standard library only.
"""
import base64
import hashlib
import hmac
import sys
import urllib.error
import urllib.request
from email.utils import formatdate

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
VERSION = "2021-08-06"


def main() -> int:
    endpoint, container = sys.argv[1].rstrip("/"), sys.argv[2]
    date = formatdate(usegmt=True)
    # Path-style (emulator) URLs put the account in the path too, so it appears twice.
    canonical_headers = f"x-ms-date:{date}\nx-ms-version:{VERSION}\n"
    canonical_resource = f"/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container"
    string_to_sign = "PUT\n\n\n\n\n\n\n\n\n\n\n\n" + canonical_headers + canonical_resource
    sig = base64.b64encode(
        hmac.new(base64.b64decode(KEY), string_to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    req = urllib.request.Request(
        f"{endpoint}/{container}?restype=container",
        method="PUT",
        data=None,
        headers={
            "x-ms-date": date,
            "x-ms-version": VERSION,
            "Authorization": f"SharedKey {ACCOUNT}:{sig}",
            "Content-Length": "0",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return 0 if resp.status in (200, 201) else 1
    except urllib.error.HTTPError as e:
        if e.code == 409:
            return 0
        sys.stderr.write(f"create container failed: {e.code} {e.read()[:300]!r}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
