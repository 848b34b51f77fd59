"""Which model a request names: the base, or one of the LoRA adapters served over it.

The OpenAI routes follow vLLM: ``model`` is the base's served name or an adapter's. TGI's
routes follow TGI: ``parameters.adapter_id`` names an adapter, absent means the base. A
name the server does not serve is a 404 in the route's error shape (vLLM's message on
/v1); the engine refuses it again (``UnknownAdapter``, the same 404) when it was unloaded
between this check and the submit.
"""

from __future__ import annotations

from service.http.errors import ApiError
from service.http.runtime import Runtime


def model_not_found(model: str, param: str = "model") -> ApiError:
    """vLLM's answer to a model it does not serve (its message and type, our envelope)."""
    return ApiError(404, f"The model `{model}` does not exist.", "not_found", param=param,
                    code="model_not_found", openai_type="NotFoundError")


def adapter_of_model(model: str | None, runtime: Runtime) -> str | None:
    """The adapter an OpenAI ``model`` field names: None for the base (or no name), the
    adapter's name for a served adapter; 404 otherwise."""
    if model is None or model == runtime.artifact.name:
        return None
    if model in runtime.adapter_names():
        return model
    raise model_not_found(model)


def adapter_of_id(adapter_id: str | None, runtime: Runtime,
                  field: str = "parameters.adapter_id") -> str | None:
    """TGI's ``adapter_id``: None for the base; a served adapter's name; 404 otherwise."""
    if adapter_id is None or adapter_id in runtime.adapter_names():
        return adapter_id
    raise ApiError(404, f"{field}: adapter {adapter_id!r} is not served by this server",
                   "not_found", param=field, code="model_not_found")
