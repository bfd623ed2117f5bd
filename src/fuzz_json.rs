//! Test-only: the arbitrary-JSON strategy shared by the property-based fuzz targets of
//! [`crate::request`] and [`crate::llm`].

use proptest::prelude::*;
use serde_json::{json, Value};

/// Any JSON value nested up to 4 levels (at most 48 nodes, 6 per collection): null, booleans,
/// integers, floats, strings of up to 40 characters, lists, and objects whose keys come from
/// `key` — a strategy, so a target can bias keys towards the names its parser looks for.
pub(crate) fn any_json(key: BoxedStrategy<String>) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (0u64..8).prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key.clone(), inner, 0..6).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
