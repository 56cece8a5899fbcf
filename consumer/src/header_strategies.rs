//! Property-test generators of AMQP header values, for the tests of [`crate::message`] (decoding
//! any delivery) and [`crate::copies`] (copying any delivery).

use lapin::types::{AMQPValue, FieldArray, FieldTable};
use proptest::prelude::*;

/// Cases per property test: few in the suite, more on demand (`PROPTEST_CASES=10000`).
pub(crate) fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(32)
}

/// `leaf` values, and arrays and tables of them (keys from `key`) nested up to 24 deep, about
/// `size` values in all, at most `branch` in one array or table.
pub(crate) fn nested(
    leaf: impl Strategy<Value = AMQPValue> + 'static,
    key: impl Strategy<Value = String> + Clone + 'static,
    size: u32,
    branch: u32,
) -> impl Strategy<Value = AMQPValue> {
    let width = 0..branch as usize;
    leaf.prop_recursive(24, size, branch, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), width.clone())
                .prop_map(|v| AMQPValue::FieldArray(FieldArray::from(v))),
            prop::collection::btree_map(key.clone(), inner, width.clone()).prop_map(|m| {
                let mut t = FieldTable::default();
                for (k, v) in m {
                    t.insert(k.as_str().into(), v);
                }
                AMQPValue::FieldTable(t)
            }),
        ]
    })
}
