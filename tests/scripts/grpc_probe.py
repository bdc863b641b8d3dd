#!/usr/bin/env python3
"""One unary gRPC call with Python grpcio (an independent client, for the TLS tests).

    grpc_probe.py ADDR METHOD [--plaintext] [--ca FILE] [--cert FILE --key FILE]
                  [--token T] [--timeout S]

METHOD is a full path such as /grpc.health.v1.Health/Check; the request is the empty
message (valid for every call the tests make). Prints `OK <n> bytes` and exits 0, or
prints `ERR <STATUS_CODE> <details>` and exits 1. Needs `pip install grpcio`.
"""
import argparse
import sys

import grpc


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("method")
    p.add_argument("--plaintext", action="store_true")
    p.add_argument("--ca")
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--token")
    p.add_argument("--timeout", type=float, default=5.0)
    a = p.parse_args()

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    if a.plaintext:
        channel = grpc.insecure_channel(a.addr)
    else:
        creds = grpc.ssl_channel_credentials(
            root_certificates=read(a.ca) if a.ca else None,
            private_key=read(a.key) if a.key else None,
            certificate_chain=read(a.cert) if a.cert else None,
        )
        channel = grpc.secure_channel(a.addr, creds)
    call = channel.unary_unary(
        a.method,
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    metadata = [("authorization", f"Bearer {a.token}")] if a.token else None
    try:
        answer = call(b"", timeout=a.timeout, metadata=metadata)
    except grpc.RpcError as e:
        details = (e.details() or "").replace("\n", " ")
        print(f"ERR {e.code().name} {details}")
        return 1
    finally:
        channel.close()
    print(f"OK {len(answer)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
