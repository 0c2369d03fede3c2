//! The publisher's blocking pass on a delta step, alone: `diff_update` of a 1 GiB BF16 model
//! at 1% density, next to one memcpy of the model (the baseline) from the same run.
//!
//! ```text
//! cargo run --release -p driftless-format --example diff_bench -- [MiB] [density]
//! ```

use std::time::Instant;

use driftless_format::{diff_update, DType, DeltaOptions, TensorView};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let mib: usize = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let density: f64 = a.get(2).and_then(|s| s.parse().ok()).unwrap_or(0.01);
    let n_tensors = 64;
    let per = (mib << 20) / n_tensors;
    // xorshift: deterministic, fast.
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let base: Vec<Vec<u8>> = (0..n_tensors).map(|_| (0..per).map(|_| next() as u8).collect()).collect();
    // Two targets that differ from the base in `density` of the elements by +-1 ulp.
    let flip = |src: &Vec<Vec<u8>>, next: &mut dyn FnMut() -> u64| -> Vec<Vec<u8>> {
        src.iter()
            .map(|t| {
                let mut d = t.clone();
                let n = d.len() / 2;
                for _ in 0..(n as f64 * density) as usize {
                    let i = (next() as usize % n) * 2;
                    let v = u16::from_le_bytes([d[i], d[i + 1]]).wrapping_add(if next() & 1 == 0 { 1 } else { 0xffff });
                    d[i..i + 2].copy_from_slice(&v.to_le_bytes());
                }
                d
            })
            .collect()
    };
    let targets = [flip(&base, &mut next), base.clone()];
    let names: Vec<String> = (0..n_tensors).map(|i| format!("t{i}")).collect();
    let shape = [(per / 2) as u64];
    let mut snap = base.clone();
    let mut copy: Vec<Vec<u8>> = base.iter().map(|t| vec![1u8; t.len()]).collect();
    let opts = DeltaOptions::default();
    let (mut diff_t, mut copy_t, mut enc_t) = (vec![], vec![], vec![]);
    let mut changed = 0;
    for rep in 0..8 {
        let target = &targets[rep % 2];
        let views: Vec<TensorView<'_>> = target
            .iter()
            .zip(&names)
            .map(|(d, n)| TensorView { name: n, dtype: DType::BF16, shape: &shape, data: d })
            .collect();
        let t = Instant::now();
        for (c, v) in copy.iter_mut().zip(&views) {
            c.copy_from_slice(v.data);
        }
        copy_t.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let diff = {
            let mut bufs: Vec<&mut [u8]> = snap.iter_mut().map(|d| &mut d[..]).collect();
            diff_update(&mut bufs, &views, &opts).unwrap()
        };
        diff_t.push(t.elapsed().as_secs_f64());
        changed = diff.stats().changed;
        let t = Instant::now();
        let enc = diff.encode().unwrap();
        enc_t.push(t.elapsed().as_secs_f64());
        std::hint::black_box(enc);
    }
    std::hint::black_box(&copy);
    let (d, c, e) = (median(diff_t), median(copy_t), median(enc_t));
    println!(
        "{mib} MiB BF16, {changed} changed: diff_update {d:.3} s = {:.2}x memcpy {c:.3} s (baseline, same run); encode after it {e:.3} s",
        d / c
    );
}
