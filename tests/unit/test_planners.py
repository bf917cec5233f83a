from wavepp.plan import Chunk, Pending, PlanContext, Wave, mpu, mpu_budget, parse_wave, static

M = 16384


def test_mpu_worked_example_from_the_design():
    """2M tokens at budget M is 2 waves; at M/2 it is 4, which feeds a ring of 4."""
    queue = [Pending("r", 0, 2 * M)]
    assert mpu_budget(queue, PlanContext(budget=M, ring=4, min_budget=512)) == M // 2
    assert mpu_budget(queue, PlanContext(budget=M, ring=8, min_budget=512)) == M // 4
    assert mpu_budget(queue, PlanContext(budget=M, ring=2, min_budget=512)) == M
    wave = mpu(queue, 0, PlanContext(budget=M, ring=4, min_budget=512))
    assert wave == Wave(0, M // 2, (Chunk("r", 0, M // 2, 2 * M),))


def test_mpu_counts_requests_with_more_than_half_a_budget_left():
    # Eight requests of 3K: W/b at 16K is 1.5 but eight requests have > 8K/2 left at 8K.
    queue = [Pending(f"r{i}", 0, 3072) for i in range(8)]
    assert mpu_budget(queue, PlanContext(budget=M, ring=8, min_budget=512)) == 4096


def test_mpu_stops_at_the_minimum_budget():
    queue = [Pending("r", 0, 100)]
    assert mpu_budget(queue, PlanContext(budget=M, ring=8, min_budget=1024)) == 1024


def test_static_fills_first_come_first_served():
    queue = [Pending("a", 0, 5000), Pending("b", 64, 20000)]
    wave = static(queue, 7, PlanContext(budget=8192, ring=8, min_budget=512))
    assert str(wave) == "w7@8192: a[0:5000/5000] b[64:3256/20000]"


def test_wave_text_form_parses_back():
    wave = Wave(3, 4096, (Chunk("req-1", 128, 2048, 9000), Chunk("x", 0, 2048, 2048)))
    assert parse_wave(str(wave)) == wave


def test_mpu_keeps_full_waves_on_one_stage():
    queue = [Pending("a", 0, 3000)]  # the tail: one request, less than a wave left
    assert mpu_budget(queue, PlanContext(budget=4096, ring=2, min_budget=512)) == 1024
    assert mpu_budget(queue, PlanContext(budget=4096, ring=2, min_budget=512, stages=1)) == 4096
