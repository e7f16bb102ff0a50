def test_health_and_models(server):
    with server.client() as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
