//! The README's `POST /refunds` is the compiled example's text, not a copy that can drift.

#[test]
fn the_readme_shows_the_compiled_refunds_example_verbatim() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = std::fs::read_to_string(root.join("examples/refunds.rs")).unwrap();
    let readme = std::fs::read_to_string(root.join("../README.md")).unwrap();
    let start = example
        .find("async fn create_refund(")
        .expect("the example defines create_refund");
    let end = example
        .find("/// What the service's own authentication")
        .expect("the example's authentication follows the route");
    let snippet = example[start..end].trim_end();
    assert!(
        readme.contains(snippet),
        "README.md must show idempotency/examples/refunds.rs from `async fn create_refund(` to the \
         end of `fn refunds` verbatim:\n{snippet}"
    );
}
