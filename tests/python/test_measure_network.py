"""python -m dcplan.measure_network's summary of what it measured (the runs themselves are in
tests/replay/test_what_if.py, on 2 Gloo ranks)."""
from dcplan import measure_network


def test_the_summary_names_each_collectives_largest_size_and_its_device_time_where_measured():
    doc = {"calibration": {"all_gather": [{"bytes": 2**20, "us": 50.0}, {"bytes": 4 * 2**20, "us": 120.0,
                                                                        "device_us": 90.0}],
                           "reduce_scatter": [{"bytes": 4 * 2**20, "us": 130.0}],
                           "h2d_gbps": 50.0}}
    assert list(measure_network.summary(doc)) == [
        "all_gather: 2 sizes up to 4.00 MiB, 0.120 ms there (0.090 ms on the device alone)",
        "reduce_scatter: 1 sizes up to 4.00 MiB, 0.130 ms there"]
