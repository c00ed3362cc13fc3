//! What the loom test files share.

/// `loom::model`, checking that it explored more than one interleaving: a
/// model whose threads share nothing loom can see would pass without
/// checking anything.
pub fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    loom::model(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        f()
    });
    let n = runs.load(std::sync::atomic::Ordering::SeqCst);
    assert!(n > 1, "loom explored {n} interleaving: the model races nothing it can see");
    eprintln!("loom explored {n} interleavings");
}
