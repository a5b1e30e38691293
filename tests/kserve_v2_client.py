"""The KServe SDK's v2 REST client against a server: run by tests/test_v2_kserve.py with the
interpreter of .venv-kserve, where the SDK lives (its pins clash with TensorFlow's).

    python tests/kserve_v2_client.py URL MODEL < {"inputs": {name: [rows]}, "binary": bool}

prints {"ready": ..., "model_ready": ..., "outputs": {name: {"datatype", "shape", "data"}}}.
"""

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

DTYPES = {"FP32": np.float32, "BYTES": np.object_}


async def main(url: str, model: str, asked: dict) -> dict:
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=60))
    try:
        inputs = []
        for name, spec in asked["inputs"].items():
            values = spec["data"] if spec["datatype"] != "BYTES" else [value.encode() for value in spec["data"]]
            array = np.array(values, dtype=DTYPES[spec["datatype"]])
            tensor = InferInput(name, list(array.shape), spec["datatype"])
            tensor.set_data_from_numpy(array, binary_data=asked["binary"])
            inputs.append(tensor)
        response = await client.infer(url, InferRequest(model, inputs), model_name=model)
        outputs = {}
        for output in response.outputs:
            array = output.as_numpy()
            data = [item.decode() if isinstance(item, bytes) else item for item in array.ravel().tolist()]
            outputs[output.name] = {"datatype": output.datatype, "shape": list(array.shape), "data": data}
        return {"ready": await client.is_server_ready(url),
                "model_ready": await client.is_model_ready(url, model), "outputs": outputs}
    finally:
        await client.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], json.load(sys.stdin)))))
