"""Past one machine: the model as N Ray Serve replicas behind the page and `/v1` (`pip install -e ".[scale]"`).

`serve.front.RemoteService` is the chat service of the front door; `serve.replica.ChatReplica` the
deployment each replica runs (the in-process `chat.service.Service`). Imports chat; chat never imports it.
"""
