"""The GPU deployment profiles: each loads, each constant and check cites its source, the checks
recompute, and the KV capacity and link follow from the constants."""

import json

import pytest

from kvmesh.sim.hardware import GIB, check_value, load_deployment
from kvmesh.sim.roofline import from_profile
from kvmesh.sim.step_cost import PROFILES, load_profile

GPU_PROFILES = sorted(p.stem for p in PROFILES.glob("*.json") if json.loads(p.read_text()).get("kind") == "roofline")


def test_the_papers_deployments_are_committed():
    assert {"mistral-large-2407-h100-bf16-tp8", "opt-13b-a100-fp16-tp1", "opt-175b-a100-fp16-tp8",
            "opt-13b-a100-40g-fp16-tp1", "llama-2-7b-l20-fp16-tp1", "yi-34b-200k-l20-bf16-tp2",
            "llama-3.1-70b-l20-bf16-tp4"} <= set(GPU_PROFILES)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_gpu_profile_loads_and_cites_every_constant(name):
    body = json.loads((PROFILES / f"{name}.json").read_text())
    deployment = load_deployment(name)
    assert deployment.name == name and deployment.cost == load_profile(name)
    assert deployment.kv_capacity_tokens > 0 and deployment.link.gbps > 0
    assert all(entry["source"].strip() for entry in body["constants"].values())
    assert set(deployment.sources) == set(body["constants"])


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_check_cites_its_publication_and_recomputes_to_what_the_profile_says(name):
    body = json.loads((PROFILES / f"{name}.json").read_text())
    assert any(not check.get("sets") for check in body["checks"])  # a factor set from a point is checked on others
    for check in body["checks"]:
        assert check["source"].strip() and check["published"] > 0
        model = check_value(body, check)
        assert check["model_value"] == pytest.approx(model, rel=1e-5, abs=1e-6)
        assert check["ratio"] == pytest.approx(model / check["published"], abs=1e-3)


def test_kvdirects_engine_holds_what_eight_h100s_leave_after_the_weights():
    deployment = load_deployment("mistral-large-2407-h100-bf16-tp8")
    params = 122_607_894_528                                 # Mistral-Large-Instruct-2407's config, counted
    free = 79.65 * GIB * 0.9 - params * 2 / 8 - 6.0 * GIB    # one GPU
    per_token = 88 * 2 * 1 * 128 * 2                         # its one KV head of 8, K and V, bf16
    assert deployment.kv_capacity_tokens == int(free // per_token)
    assert deployment.geometry.block_bytes(16) * 88 / 16 == 360_448  # KVDirect Sec. 5.1: 352 KB a token
    assert deployment.link.gbps == pytest.approx(8 * 22.23)        # one 400 Gbps NIC per GPU
    assert deployment.tier.to_device_gbs == deployment.tier.from_device_gbs == 8 * 50.0  # each GPU its own PCIe Gen5
    spec = deployment.engine_spec(block_size=16, max_num_seqs=256)
    assert spec.num_layers == 88 and spec.max_num_seqs == 256
    assert spec.device_blocks == deployment.kv_capacity_tokens // 16 * 88


def test_layerkvs_paired_gpus_share_their_pcie_link_under_tensor_parallelism():
    alone, paired = load_deployment("llama-2-7b-l20-fp16-tp1"), load_deployment("yi-34b-200k-l20-bf16-tp2")
    assert alone.tier.to_device_gbs == 25.0 and paired.tier.to_device_gbs == 2 * 12.5


def test_a_cpu_profile_is_not_a_deployment():
    with pytest.raises(ValueError, match="not a GPU deployment"):
        load_deployment("tiny-cpu-bfloat16-1t")


def test_a_deployments_cxl_tier_copies_its_blocks_at_the_tiers_bandwidth():
    deployment = load_deployment("mistral-large-2407-h100-bf16-tp8")
    spec = deployment.engine_spec(block_size=16, cxl_blocks=1000)
    assert spec.cxl_blocks == 1000
    assert spec.block_bytes == 2 * 16 * 8 * 128 * 2           # K and V of 16 tokens, 8 KV heads of 128, bf16
    assert spec.swap_out_bytes_per_s == spec.swap_in_bytes_per_s == 8 * 50.0e9  # each GPU its own PCIe Gen5
    assert deployment.engine_spec(block_size=16).cxl_blocks == 0


def test_an_engine_spec_override_wins_over_the_deployments_tier():
    spec = load_deployment("llama-2-7b-l20-fp16-tp1").engine_spec(block_size=16, cxl_blocks=10,
                                                                 swap_in_bytes_per_s=1e9)
    assert spec.swap_in_bytes_per_s == 1e9 and spec.swap_out_bytes_per_s == 25.0e9  # the tier's, from the device


def test_decode_attention_reads_the_kv_at_its_own_share_of_the_bandwidth_and_only_the_decodes_kv():
    body = json.loads((PROFILES / "mistral-large-2407-h100-bf16-tp8.json").read_text())
    slow = body["constants"] | {"decode_attention_efficiency": {"value": 0.3835, "source": "half the GEMV's"}}
    base, halved = from_profile(body), from_profile(body | {"constants": slow})
    kv_s = base.kv_bytes_per_token_per_gpu / (3350e9 * 0.767)
    # A decode of 13 sequences over 858,637 tokens: the KV read costs twice as long, the rest as before.
    assert halved.memory_s(13, 858_637) - base.memory_s(13, 858_637) == pytest.approx(858_637 * kv_s, rel=1e-9)
    assert halved.seconds(0, 13, 858_637, 0) - base.seconds(0, 13, 858_637, 0) == pytest.approx(858_637 * kv_s,
                                                                                               rel=1e-9)
    assert halved.seconds(4096, 0, 0, 8_390_656) == base.seconds(4096, 0, 0, 8_390_656)  # a prefill reads no KV


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_a_decode_attention_efficiency_equal_to_the_gemvs_changes_no_float(name):
    body = json.loads((PROFILES / f"{name}.json").read_text())
    same = body["constants"] | {"decode_attention_efficiency": body["constants"]["hbm_efficiency"]}
    without = {key: entry for key, entry in body["constants"].items() if key != "decode_attention_efficiency"}
    for step in ((0, 96, 835_680, 0), (4096, 13, 858_637, 8_390_656), (1, 1, 191, 1)):
        assert from_profile(body | {"constants": same}).seconds(*step) == from_profile(
            body | {"constants": without}).seconds(*step)
