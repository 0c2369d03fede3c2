#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    driftless_fuzz::decode_segment(data);
});
