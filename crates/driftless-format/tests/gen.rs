//! The RL chain generator behaves like RL fine-tuning: sparse, mostly +-1 ulp changes.

use driftless_format::gen::{change_stats, ModelSpec, RlChain};

#[test]
fn rl_chain_density_and_ulp() {
    let spec = ModelSpec::with_bf16_bytes(4 << 20);
    for (lr, seed) in [(1e-6f32, 1u64), (2e-6, 2), (3e-6, 3)] {
        let mut chain = RlChain::new(&spec, lr, seed);
        assert!(chain.bytes() > (3 << 20) && chain.bytes() < (6 << 20), "model of {} bytes", chain.bytes());
        for _ in 0..3 {
            let before: Vec<Vec<u8>> = chain.views().iter().map(|v| v.data.to_vec()).collect();
            let metas = chain.metas().to_vec();
            chain.step();
            let prev: Vec<driftless_format::TensorView<'_>> = metas
                .iter()
                .zip(&before)
                .map(|(m, d)| driftless_format::TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d })
                .collect();
            let (total, changed, one) = change_stats(&prev, &chain.views());
            let density = changed as f64 / total as f64;
            let one_frac = one as f64 / changed.max(1) as f64;
            println!(
                "lr {lr:e} step {}: {total} elements, {changed} changed (density {:.3}%), {:.1}% of changes +-1 ulp",
                chain.step_count(),
                density * 100.0,
                one_frac * 100.0
            );
            assert_eq!(total * 2, chain.bytes());
            assert!((0.001..=0.10).contains(&density), "lr {lr}: density {density} outside 0.1%..10%");
            assert!(one_frac > 0.5, "lr {lr}: only {one_frac} of changes are +-1 ulp");
        }
    }
}

#[test]
fn rl_chain_is_deterministic() {
    let spec = ModelSpec::with_bf16_bytes(64 << 10);
    let mut a = RlChain::new(&spec, 2e-6, 9);
    let mut b = RlChain::new(&spec, 2e-6, 9);
    let mut c = RlChain::new(&spec, 2e-6, 10);
    for _ in 0..2 {
        a.step();
        b.step();
        c.step();
    }
    let root = |x: &RlChain| driftless_format::weights_root(&x.views()).1;
    assert_eq!(root(&a), root(&b));
    assert_ne!(root(&a), root(&c));
}
