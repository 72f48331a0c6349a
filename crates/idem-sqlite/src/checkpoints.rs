//! The checkpoints of a record, kept in its row as one blob (the `checkpoints` column): a format
//! byte, then each checkpoint in the order its name was first written, as its name and its value,
//! each a big-endian `u32` length followed by that many bytes. `NULL` is the empty list.

use std::io;

use bytes::Bytes;
use idem_core::{StoreError, store::Checkpoint};

/// The first byte of every encoded list, so that a later format can be told apart.
const FORMAT: u8 = 1;

/// One checkpoint as it lies in the blob: borrowed, not copied.
struct Entry<'a> {
    name: &'a str,
    value: &'a [u8],
}

/// The checkpoints held in `blob` (`None` for a row without any).
pub(crate) fn decode(blob: Option<&[u8]>) -> Result<Vec<Checkpoint>, StoreError> {
    Ok(entries(blob)?
        .into_iter()
        .map(|entry| Checkpoint {
            name: entry.name.to_owned(),
            value: Bytes::copy_from_slice(entry.value),
        })
        .collect())
}

/// The list in `blob` with `checkpoint` recorded: it replaces the value of the checkpoint of the
/// same name in its place, or comes last if its name is new.
pub(crate) fn with(blob: Option<&[u8]>, checkpoint: &Checkpoint) -> Result<Vec<u8>, StoreError> {
    let mut list = entries(blob)?;
    let new = Entry {
        name: &checkpoint.name,
        value: &checkpoint.value,
    };
    match list.iter_mut().find(|entry| entry.name == new.name) {
        Some(entry) => *entry = new,
        None => list.push(new),
    }
    encode(&list)
}

fn encode(list: &[Entry<'_>]) -> Result<Vec<u8>, StoreError> {
    let size = list
        .iter()
        .map(|entry| 8 + entry.name.len() + entry.value.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(1 + size);
    out.push(FORMAT);
    for entry in list {
        put(&mut out, entry.name.as_bytes())?;
        put(&mut out, entry.value)?;
    }
    Ok(out)
}

/// Appends `bytes` with their length.
fn put(out: &mut Vec<u8>, bytes: &[u8]) -> Result<(), StoreError> {
    let len = u32::try_from(bytes.len()).map_err(|_| {
        let err = io::Error::new(
            io::ErrorKind::InvalidInput,
            "a checkpoint's name or value exceeds 4 GiB",
        );
        StoreError::unavailable(err)
    })?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes);
    Ok(())
}

fn entries(blob: Option<&[u8]>) -> Result<Vec<Entry<'_>>, StoreError> {
    let Some(blob) = blob else {
        return Ok(Vec::new());
    };
    let Some((&FORMAT, mut rest)) = blob.split_first() else {
        return Err(corrupt("an unknown format"));
    };
    let mut list = Vec::new();
    while !rest.is_empty() {
        let name = field(&mut rest).ok_or_else(|| corrupt("a truncated name"))?;
        let name = std::str::from_utf8(name).map_err(|_| corrupt("a name that is not UTF-8"))?;
        let value = field(&mut rest).ok_or_else(|| corrupt("a truncated value"))?;
        list.push(Entry { name, value });
    }
    Ok(list)
}

/// Takes one length-prefixed field off the front of `rest`; `None` if it is cut short.
fn field<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (len, tail) = rest.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
    if tail.len() < len {
        return None;
    }
    let (field, tail) = tail.split_at(len);
    *rest = tail;
    Some(field)
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("the checkpoints of a record hold {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, value: &[u8]) -> Checkpoint {
        Checkpoint {
            name: name.to_owned(),
            value: Bytes::copy_from_slice(value),
        }
    }

    #[test]
    fn a_name_keeps_its_place_and_takes_the_new_value() {
        let blob = with(None, &step("reserved", b"order 7")).unwrap();
        let blob = with(Some(&blob), &step("charged", b"\0\xffch_1")).unwrap();
        let blob = with(Some(&blob), &step("reserved", b"order 8")).unwrap();
        let blob = with(Some(&blob), &step("", b"")).unwrap();
        assert_eq!(
            decode(Some(&blob)).unwrap(),
            vec![
                step("reserved", b"order 8"),
                step("charged", b"\0\xffch_1"),
                step("", b"")
            ]
        );
        assert!(decode(None).unwrap().is_empty());
    }

    #[test]
    fn a_damaged_list_is_corrupt() {
        let blob = with(None, &step("charged", b"ch_1")).unwrap();
        for damaged in [&b""[..], &[2], &blob[..blob.len() - 1], &blob[..3]] {
            assert!(
                matches!(decode(Some(damaged)), Err(StoreError::Corrupt(_))),
                "{damaged:?}"
            );
        }
        let mut not_utf8 = blob.clone();
        not_utf8[5] = 0xff;
        assert!(matches!(decode(Some(&not_utf8)), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            with(Some(&not_utf8), &step("x", b"")),
            Err(StoreError::Corrupt(_))
        ));
    }
}
