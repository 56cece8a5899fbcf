//! docs/consumer.md shows the compiled handler example, not a copy that can drift.

#[test]
fn the_consumer_docs_show_the_compiled_custom_handler_example_verbatim() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = std::fs::read_to_string(root.join("examples/custom_handler.rs")).unwrap();
    let docs = std::fs::read_to_string(root.join("../docs/consumer.md")).unwrap();
    let start = example
        .find("use consumer::")
        .expect("the example starts with its imports");
    let code = example[start..].trim_end();
    assert!(
        docs.contains(code),
        "docs/consumer.md must show consumer/examples/custom_handler.rs from its imports on \
         verbatim:\n{code}"
    );
}
