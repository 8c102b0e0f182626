//! Model-supplied JSON against every contract function's parameter type: conversion either
//! refuses with a path or yields a value whose JSON form converts again to the same value
//! (what the pipeline relies on when it digests normalized arguments).
#![no_main]

use std::sync::OnceLock;

use airlock_runtime::contract::{self, Shape};
use libfuzzer_sys::fuzz_target;

fn shapes() -> &'static Vec<Shape> {
    static SHAPES: OnceLock<Vec<Shape>> = OnceLock::new();
    SHAPES.get_or_init(|| {
        let mut all = Vec::new();
        for name in contract::known_contracts() {
            let c = contract::load_contract(&name).expect("a shipped contract loads");
            for f in c.functions.values() {
                for (_, shape) in &f.params {
                    all.push(shape.clone());
                }
            }
        }
        all
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, json)) = data.split_first() else {
        return;
    };
    let shapes = shapes();
    let shape = &shapes[pick as usize % shapes.len()];
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(json) else {
        return;
    };
    let mut handles = |_: &str, token: &str| Ok::<_, String>(format!("loc:{token}"));
    if let Ok(val) = contract::json_to_val(shape, &value, &mut handles) {
        let back = contract::val_to_json(shape, &val, &mut |_, locator| Ok(locator.to_string()))
            .expect("a converted value renders");
        let mut same = |_: &str, token: &str| Ok::<_, String>(token.to_string());
        let again = contract::json_to_val(shape, &back, &mut same)
            .expect("a rendered value converts again");
        assert_eq!(
            format!("{val:?}"),
            format!("{again:?}"),
            "round trip changed the value"
        );
    }
});
