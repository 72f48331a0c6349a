//! The config file's values: the text the flags take, and TOML's own types where they fit (a size
//! as an integer of bytes, methods as an array). An error names what was expected; the file's
//! reader adds the line and the setting.

use std::fmt::Display;
use std::str::FromStr;
use std::time::Duration;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};

use crate::units::{parse_duration, parse_method, parse_size};

/// A value that parses from its text like the flag of the same name.
pub(crate) fn parsed<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: Display,
{
    let text = String::deserialize(deserializer)?;
    text.parse().map(Some).map_err(D::Error::custom)
}

/// A humantime duration: `"24h"`, `"500ms"`.
pub(crate) fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_duration(&text).map(Some).map_err(D::Error::custom)
}

/// A size: `"256KiB"`, or a number of bytes.
pub(crate) fn size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged, expecting = "a size such as \"256KiB\" or a number of bytes")]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(deserializer)? {
        Size::Bytes(bytes) => usize::try_from(bytes)
            .map(Some)
            .map_err(|_| D::Error::custom(format!("{bytes} bytes is too large"))),
        Size::Text(text) => parse_size(&text).map(Some).map_err(D::Error::custom),
    }
}

/// Methods: `["POST", "PATCH"]` or `"POST,PATCH"`.
pub(crate) fn methods<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Vec<http::Method>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(
        untagged,
        expecting = "methods as a list such as [\"POST\", \"PATCH\"] or a string \"POST,PATCH\""
    )]
    enum Methods {
        List(Vec<String>),
        Text(String),
    }
    let list = match Methods::deserialize(deserializer)? {
        Methods::List(list) => list,
        Methods::Text(text) => text.split(',').map(str::to_owned).collect(),
    };
    list.iter()
        .map(|method| parse_method(method))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
        .map_err(D::Error::custom)
}
