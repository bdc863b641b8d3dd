#!/usr/bin/env python3
"""A small grpcurl stand-in built on server reflection (pip install grpcio grpcio-reflection).

    python3 deploy/grpc_reflect.py HOST:PORT list
    python3 deploy/grpc_reflect.py HOST:PORT describe rookworld.queue.v1.RolloutQueue
    python3 deploy/grpc_reflect.py HOST:PORT call rookworld.queue.v1.RolloutQueue/PeekGroups '{"count": 4}'

Requests and answers are JSON (proto3 JSON mapping). Exit 1 with one line on an error.
TLS, as the services' clients take it: ROOKWORLD_TLS_CA (the CA file; TLS when set), and
for mutual TLS ROOKWORLD_TLS_CLIENT_CERT and ROOKWORLD_TLS_CLIENT_KEY.
"""

import os
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


def open_channel(addr):
    ca = os.environ.get("ROOKWORLD_TLS_CA")
    if not ca:
        return grpc.insecure_channel(addr)

    def read(var):
        path = os.environ.get(var)
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(
        root_certificates=read("ROOKWORLD_TLS_CA"),
        private_key=read("ROOKWORLD_TLS_CLIENT_KEY"),
        certificate_chain=read("ROOKWORLD_TLS_CLIENT_CERT"),
    )
    return grpc.secure_channel(addr, creds)


def main(argv):
    if len(argv) < 3 or argv[2] not in ("list", "describe", "call"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    addr, verb = argv[1], argv[2]
    channel = open_channel(addr)
    database = ProtoReflectionDescriptorDatabase(channel)
    if verb == "list":
        for name in database.get_services():
            print(name)
        return 0
    pool = descriptor_pool.DescriptorPool(database)
    if verb == "describe":
        service = pool.FindServiceByName(argv[3])
        for m in service.methods:
            print(f"{m.name}({m.input_type.full_name}) returns ({m.output_type.full_name})")
        return 0
    service_name, method_name = argv[3].rsplit("/", 1)
    method = pool.FindServiceByName(service_name).FindMethodByName(method_name)
    request_class = message_factory.GetMessageClass(method.input_type)
    answer_class = message_factory.GetMessageClass(method.output_type)
    request = json_format.Parse(argv[4] if len(argv) > 4 else "{}", request_class())
    call = channel.unary_unary(
        f"/{service_name}/{method_name}",
        request_serializer=request_class.SerializeToString,
        response_deserializer=answer_class.FromString,
    )
    metadata = []
    if len(argv) > 5:
        metadata.append(("authorization", f"Bearer {argv[5]}"))
    answer = call(request, timeout=15, metadata=metadata)
    print(json_format.MessageToJson(answer, preserving_proto_field_name=True))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)
    except (KeyError, ValueError, json_format.ParseError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
