"""The artifact contract: what crosses from export/ to service/.

Graph input/output names (io_spec, engine_spec), the artifact config, the manifest and
its verification, which graph runs which pass (graphs), and the chat template's rendering
(what a conversation becomes as text: the fine-tuner in model/ and the server must agree
on it). Torch-free: export/ writes artifacts through it, the service reads them through
it, and nothing in here imports model/ or export/.
"""
