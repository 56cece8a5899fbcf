"""Reads CloudEvents from a RabbitMQ queue with code nobody in this project wrote.

pika (the RabbitMQ team's Python client) takes each delivery off the queue and decodes its AMQP 0.9.1
header table; the CloudEvents Python SDK's AMQP binding (cloudevents.core.bindings.amqp) then reads
the event in binary content mode from those headers as AMQP 1.0 application properties (what
RabbitMQ 4.x turns them into) and the content type as the `content-type` property, and validates it.

Usage: cloudevents_reader.py AMQP_URL QUEUE COUNT
Prints one JSON object per event on stdout: the delivery's message id and routing key, the event's
attributes (the time as RFC 3339) and its data. Exits non-zero on anything unexpected: a missing
package, fewer than COUNT messages, or an event the SDK refuses.
"""

import json
import sys
import time

import pika
from cloudevents.core.bindings import amqp


def text(value):
    """pika gives long strings as str when they are UTF-8, else bytes."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def main():
    url, queue, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    read = 0
    deadline = time.monotonic() + 30
    while read < count:
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            if time.monotonic() > deadline:
                sys.exit(f"only {read} of {count} messages arrived in {queue}")
            time.sleep(0.1)
            continue
        read += 1
        message = amqp.AMQPMessage(
            properties={"content-type": properties.content_type},
            application_properties={
                name: text(value) for name, value in (properties.headers or {}).items()
            },
            application_data=body,
        )
        event = amqp.from_binary_event(message)
        attributes = {
            name: value.isoformat() if hasattr(value, "isoformat") else value
            for name, value in event.get_attributes().items()
        }
        print(
            json.dumps(
                {
                    "message_id": properties.message_id,
                    "routing_key": method.routing_key,
                    "created_at": text((properties.headers or {}).get("created_at")),
                    "attributes": attributes,
                    "data": event.get_data(),
                }
            )
        )
    connection.close()


if __name__ == "__main__":
    main()
